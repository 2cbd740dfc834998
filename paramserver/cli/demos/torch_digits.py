"""The digits job with a PyTorch model: ``paramserver worker|demo --framework torch``.

Same data split, loop, server-side rule and reports as the numpy job
(:mod:`paramserver.cli.demos.digits`); only the model differs: a ``torch.nn.Sequential``
MLP (``Linear(64, hidden) -> Tanh -> Linear(hidden, 10)``, or ``Linear(64, 10)`` with
``hidden == 0``) in float32, PyTorch's default initialisation under ``torch.manual_seed(seed)``,
cross-entropy loss, gradients by autograd. Parameters and gradients cross the wire by name
through :mod:`paramserver.integrations.torch` (keys ``"0.weight"``, ``"0.bias"``, ``"2.weight"``,
...).

Needs ``pip install 'paramserver[torch]'``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from paramserver.integrations.torch import gradients, load_parameters, module_parameters


def build_mlp(hidden: int, seed: int = 0) -> torch.nn.Module:
    """The digits MLP: 64 inputs, ``hidden`` tanh units (0: none), 10 logits; float32."""
    torch.manual_seed(seed)
    if hidden:
        return torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10)
        )
    return torch.nn.Sequential(torch.nn.Linear(64, 10))


class TorchMLP:
    """:class:`~paramserver.cli.demos.digits.DigitsModel` backed by a torch module.

    Args:
        hidden: Hidden units (0: softmax regression).
        seed: Seed of the initial parameters.
        threads: ``torch.set_num_threads`` for this process (None: leave torch's default);
            a worker process among several on one host wants 1.
    """

    def __init__(self, hidden: int, seed: int = 0, *, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.module = build_mlp(hidden, seed)

    def initial_params(self) -> dict[str, np.ndarray]:
        """The module's initial parameters by name (copies)."""
        return {k: v.copy() for k, v in module_parameters(self.module).items()}

    def loss_and_grads(
        self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[float, dict[str, np.ndarray]]:
        """Load ``params`` into the module, backward the mean cross-entropy of ``(x, y)``.

        Args:
            params: Pulled parameters by name (float32).
            x: float64 (n, 64) inputs; y: int64 (n,) labels.

        Returns:
            The batch loss and name -> float32 gradient (copies, safe to keep).
        """
        load_parameters(self.module, params)
        self.module.zero_grad(set_to_none=True)
        logits = self.module(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        torch.autograd.backward(loss)
        grads = {k: v.copy() for k, v in gradients(self.module).items()}
        return float(loss.item()), grads

    def accuracy(self, params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        """Fraction of ``x`` (float64 (n, 64)) the module with ``params`` classifies as ``y``."""
        load_parameters(self.module, params)
        with torch.no_grad():
            logits = self.module(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        return float((logits.argmax(dim=1).numpy() == y).mean())
