"""Bit allocation lives in the library (:mod:`rvqstore.bit_allocation`, used by the presets);
re-exported here for the evaluation."""

from rvqstore.bit_allocation import (OPTIONS, PROBE, allocate, allocate_steps, average_bits, grid_bits, load_profile,
                                     predicted)

__all__ = ["OPTIONS", "PROBE", "allocate", "allocate_steps", "average_bits", "grid_bits", "load_profile", "predicted"]
