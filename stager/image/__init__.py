"""Image mode: a dataset as one read-only filesystem image (docs/image-mode.md).

One module per job: ``erofs`` writes the format, ``build`` turns a tar stream or a
tree into an image, ``mount`` mounts it read-only (the kernel as root, FUSE as a
user) and takes it down, ``identity`` says whether an image file is still the one
measured, ``command`` is ``stager image``. Nothing here imports the engine: the
staging's hooks call these.
"""
