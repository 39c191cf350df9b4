"""Shared fixtures: the kvslim package under test and the C++ reference runner (kvslim_pyref)."""
import os
import shutil

import pytest


@pytest.fixture(scope="session")
def pyref():
    path = os.environ.get("KVSLIM_PYREF") or shutil.which("kvslim_pyref")
    if not path or not os.path.exists(path):
        # Not a skip: the comparison with C++ is the point of these tests (ctest and .ci/run set it).
        pytest.fail("KVSLIM_PYREF is not set to the kvslim_pyref binary (build target kvslim_pyref)")
    return path
