"""Test setup shared by every test module.

* Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter; the flag must
  be set before triton is first imported, so it is set here (unless the caller chose already).
* Hypothesis profiles ``ci`` / ``gpu`` / ``nightly`` are chosen by PORTATTN_HYPOTHESIS_PROFILE.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --- Hypothesis profiles (owned by the equivalence suite; see docs/conformance.md) ----------
try:
    from hypothesis import HealthCheck, Phase, settings

    _common = dict(deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])
    settings.register_profile("ci", max_examples=25, derandomize=True, database=None, **_common)
    settings.register_profile("gpu", max_examples=300, **_common)
    settings.register_profile("nightly", max_examples=3000,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                              **_common)
    from portattn import config as _config

    settings.load_profile(_config.hypothesis_profile())
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
# --- end Hypothesis profiles ----------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@pytest.fixture
def seeded():
    """A torch.Generator seeded per test, for reproducible random inputs."""
    return torch.Generator().manual_seed(1234)
