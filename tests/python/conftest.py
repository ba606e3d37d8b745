"""Shared fixtures of the Python tests: the golden checkpoints shipped with the crate's tests
(ModelOpt 0.47 NVFP4 / official MXFP4 tiny layers and float64 reference outputs)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import safetensors_np as st  # noqa: E402

DATA = os.path.join(HERE, "..", "..", "crates", "megamoe", "tests", "data")
FORMATS = ("nvfp4-tiny", "mxfp4-tiny")


def fixture_dir(name: str) -> str:
    """The checkpoint directory of fixture `name`."""
    return os.path.join(DATA, name)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 error, the fixtures' tolerance measure."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


#: Tolerances the fixtures' README gives a correct engine (relative L2 of the outputs).
TOL = {"w4a16": 2e-3, "w4a8": 2e-2, "w4a4": 2e-2}


@pytest.fixture(scope="session")
def golden():
    """golden.safetensors of each fixture, by fixture name."""
    return {f: st.load(os.path.join(fixture_dir(f), "golden.safetensors")) for f in FORMATS}


@pytest.fixture(scope="session")
def weights():
    """model.safetensors of each fixture, by fixture name."""
    return {f: st.load(os.path.join(fixture_dir(f), "model.safetensors")) for f in FORMATS}
