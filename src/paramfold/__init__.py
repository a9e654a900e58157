"""paramfold: make ``torch.compile`` fast on models that use ``torch.nn.utils.parametrize``."""

__version__ = "0.1.0"
