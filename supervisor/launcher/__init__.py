"""Launchers run training segments: the `Launcher` protocol, the local process group, and torchrun."""

from supervisor.launcher.base import ExitInfo, Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.launcher.local import LocalLauncher, LocalSegment, process_started
from supervisor.launcher.torchrun import TorchrunLauncher, TorchrunOptions

__all__ = [
    "ExitInfo",
    "LaunchSpec",
    "Launcher",
    "LocalLauncher",
    "LocalSegment",
    "OnLine",
    "SegmentHandle",
    "TorchrunLauncher",
    "TorchrunOptions",
    "process_started",
]
