"""Archives: formats, member judging, the member writer and the readers extract uses."""
