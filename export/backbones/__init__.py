"""The backbone architectures defined in the project (no torchvision), one module per
family. They are added and looked up by name in :mod:`export.architectures`, the registry."""
