"""A ``transformers`` model as it is: the parallel hooks its config implies (:func:`adopt`), its plans translated onto
the package's styles and stage split."""

from lightning_mgpu.hf.hooks import HFHooks, adopt
from lightning_mgpu.hf.model import HFModel, find_hf_model

__all__ = ["HFHooks", "HFModel", "adopt", "find_hf_model"]
