import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from daskgen.errors import InputError
from daskgen.input.rows import (
    ROW_NUMBERING,
    check_lengths,
    fingerprint,
    iter_rows,
    iter_token_ids,
    read_rows,
    scan_prompts,
)
from daskgen.input.tokenizer import ByteTokenizer


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_read_the_same(tmp_path):
    rows = [{"prompt": "hi", "id": "a"}, {"messages": [{"role": "user", "content": "yo"}], "id": "b"}]
    jl = read_rows(write_jsonl(tmp_path / "p.jsonl", rows))
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "hi", "id": "a"}, {"prompt": "yo", "id": "b"}]), tmp_path / "p.parquet"
    )
    pa_rows = read_rows(tmp_path / "p.parquet")
    assert jl == rows
    assert [r["id"] for r in pa_rows] == ["a", "b"]


@pytest.mark.parametrize(
    ("rows", "fragment"),
    [
        (['{"prompt": "ok"}', '{"prompt": '], "line 2: not valid JSON"),
        ([{"prompt": 5}], "row 0: column 'prompt': expected a string, found int"),
        ([{"text": "x"}], "row 0: missing column 'messages' or 'prompt'"),
        ([{"messages": []}], "row 0: column 'messages': empty conversation"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], "role 'robot' is not one of"),
        ([{"messages": [{"role": "user", "content": 3}]}], "'content' must be a string"),
        ([{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}], "row 1: column 'id': duplicate id '1'"),
        ([{"prompt": "  "}], "empty string"),
        ([{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}], "has both"),
    ],
)
def test_bad_rows_are_reported_with_row_and_column(tmp_path, rows, fragment):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(InputError) as err:
        scan_prompts(path, ByteTokenizer(), max_prompt_tokens=1000)
    assert fragment in str(err.value)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match="empty"):
        read_rows(tmp_path / "empty.jsonl")
    with pytest.raises(InputError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(InputError, match="expected .jsonl"):
        read_rows(tmp_path / "p.csv")


def test_all_errors_reported_together(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": 1}, {"prompt": "ok"}, {"x": 1}])
    with pytest.raises(InputError) as err:
        scan_prompts(path, ByteTokenizer(), max_prompt_tokens=1000)
    text = str(err.value)
    assert "2 problem(s)" in text and "row 0: column 'prompt'" in text and "row 2: missing column" in text
    assert ROW_NUMBERING in text  # the rows are the store's prompt_index; row N is line N + 1 of the file


def test_rows_are_numbered_as_the_store_numbers_prompts(tmp_path):
    """An error names a row by the index its prompt has in the store (a Python list's index, a Parquet row's
    position, a JSONL line's number minus one); a line that is no JSON object is named by its line."""
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "x" * 50}]
    assert [i for i, _ in iter_rows(rows)] == [0, 1, 2]
    assert [i for i, _ in iter_rows(write_jsonl(tmp_path / "p.jsonl", rows))] == [0, 1, 2]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert [i for i, _ in iter_rows(tmp_path / "p.parquet")] == [0, 1, 2]
    scan = scan_prompts(tmp_path / "p.jsonl", ByteTokenizer(), max_prompt_tokens=30, skip_overlong=True)
    assert list(scan.overlong) == [2]
    with pytest.raises(InputError, match=r"(?s)row 2: column 'messages'/'prompt': prompt has 51 tokens"):
        scan_prompts(tmp_path / "p.jsonl", ByteTokenizer(), max_prompt_tokens=30)
    (tmp_path / "bom.jsonl").write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n'
    )  # as Windows tools write
    assert read_rows(tmp_path / "bom.jsonl") == [{"prompt": "a"}, {"prompt": "b"}]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n')
    with pytest.raises(InputError, match="line 2: empty line"):
        read_rows(tmp_path / "bad.jsonl")


def test_overlong_error_or_skip():
    ids = {0: 5, 1: 50}
    with pytest.raises(InputError, match=r"(?s)row 1: .*50 tokens.*--skip-overlong"):
        check_lengths(ids, 10, skip=False)
    assert list(check_lengths(ids, 10, skip=True)) == [1]


def test_scan_streams_validates_fingerprints_and_finds_overlong(tmp_path):
    rows = [{"prompt": "abc"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x" * 100}]
    scan = scan_prompts(rows, ByteTokenizer(), max_prompt_tokens=30, skip_overlong=True)
    assert (scan.n_rows, list(scan.overlong)) == (3, [2])
    assert scan.fingerprint == fingerprint(rows)
    assert fingerprint(rows) != fingerprint(rows[:2])
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert scan_prompts(path, ByteTokenizer(), max_prompt_tokens=200).fingerprint == scan.fingerprint
    tokens = {i: ids for i, ids, _ in iter_token_ids(path, ByteTokenizer(), iter([0, 2]))}
    assert tokens[0] == [1, 97 + 3, 98 + 3, 99 + 3] and len(tokens[2]) == 101


def test_scan_reports_duplicate_ids_and_bad_rows_together():
    rows = [{"prompt": "a", "id": 1}, {"prompt": 5}, {"prompt": "b", "id": 1}]
    with pytest.raises(InputError) as err:
        scan_prompts(rows, ByteTokenizer(), max_prompt_tokens=20)
    assert "row 1: column 'prompt'" in str(err.value) and "row 2: column 'id': duplicate id '1'" in str(err.value)
