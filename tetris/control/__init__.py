"""The control plane: route, plan, commit and the queue-time model, driven by the live
dispatcher and by the simulator alike (``plane.ControlPlane``). Imports no Ray or torch."""

from tetris.control.plane import Admission, ControlPlane
from tetris.control.queue import PrefillQueue

__all__ = ["Admission", "ControlPlane", "PrefillQueue"]
