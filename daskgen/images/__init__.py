"""Images in prompts: the checks of the input scan (:mod:`~daskgen.images.scan`) and the model's image processor
(:mod:`~daskgen.images.processor`).  Reading an image's bytes from its URL (:mod:`daskgen.store.objects.image_urls`) and
what the store keeps of each image, its bytes or a reference (:mod:`daskgen.store.images`), lie in the store's
folder, whose readers resolve references.  Where rows name images is :mod:`daskgen.input.image_refs`,
the placeholder tokens they expand to :mod:`daskgen.input.image_tokens`; the worker's side
:mod:`daskgen.worker.images`.

Importing this package imports neither Pillow nor transformers; the modules that need them import them inside
their functions.
"""
