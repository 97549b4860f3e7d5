"""The published GLM configs (config.json only, no weights) that `zcode info NAME` reads by name,
and the fit planner's defaults. Kept free of torch: the CLI's parser reads them at start-up."""

from pathlib import Path

CONFIGS_DIR = Path(__file__).parent
DEFAULT_CONTEXT_LEN = 4096  # tokens of KV cache a fit plan reserves
DEFAULT_DISK_GBPS = 2.0  # read bandwidth assumed for experts offloaded to disk (an NVMe SSD)


def shipped_configs() -> list[str]:
    """Names of the published configs beside this file (`zcode info glm-5`)."""
    return sorted(p.parent.name for p in CONFIGS_DIR.glob("*/config.json"))
