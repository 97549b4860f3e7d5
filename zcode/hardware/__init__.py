"""Portability layer: what this machine is and what it measurably does."""

from zcode.hardware.probe import CudaDevice, HardwareInfo, format_report, probe

__all__ = ["CudaDevice", "HardwareInfo", "format_report", "probe"]
