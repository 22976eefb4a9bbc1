"""Images in prompts: reading their bytes (:mod:`~daskgen.images.fetch`), the checks of the input scan
(:mod:`~daskgen.images.scan`), the store's content-addressed copies (:mod:`~daskgen.store.images`) and the model's
image processor (:mod:`~daskgen.images.processor`).  Where rows name images is :mod:`daskgen.input.image_refs`,
the placeholder tokens they expand to :mod:`daskgen.input.image_tokens`; the worker's side
:mod:`daskgen.worker.images`.

Importing this package imports neither Pillow nor transformers; the modules that need them import them inside
their functions.
"""
