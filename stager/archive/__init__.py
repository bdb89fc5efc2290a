"""Archives: formats, the extraction (its pools, the tar and zip readers, nested
archives), the member writer that judges and writes members, and the ImageNet
devkit reader."""
