"""Optimizers whose step spans a layout's splits: Muon orthogonalises each weight matrix whole
(:mod:`~lightning_mgpu.optim.muon`), from the pieces a rank holds (:mod:`~lightning_mgpu.optim.whole_matrices`)."""

from lightning_mgpu.optim.muon import MuonWithAdamW, bind_whole_matrices, is_matrix_optimizer, tag_state_keys

__all__ = ["MuonWithAdamW", "bind_whole_matrices", "is_matrix_optimizer", "tag_state_keys"]
