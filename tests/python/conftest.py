"""Shared helpers of the Python package's tests: inputs every rank makes alike, gloo ranks started
with torch.multiprocessing, and the reference system's tiers transcribed in PyTorch."""
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def port():
    return free_port()
