"""parapilot: a pure-Python client of the parapilot agent's bus, and its PyTorch and TensorFlow
integrations.

    from parapilot import wire, Client          # the protocol (standard library only)
    from parapilot.pytorch import Session       # DDP telemetry, comm hook, shares (needs torch)
    from parapilot.tensorflow import Session    # MultiWorkerMirroredStrategy jobs (no torch)
    from parapilot.pipeline import PipelineSession   # pipeline jobs whose stages move (torch >= 2.4)

See docs/pytorch.md, docs/tensorflow.md and docs/wire-format.md.
"""

from .auth import Secret, SecretError, load_secret, load_secret_from_env, load_secret_from_file
from .client import Client, ClientStats, logging_logger
from .plans import PlanBook
from . import wire

__version__ = "0.1.0"
__all__ = ["wire", "Client", "ClientStats", "PlanBook", "Secret", "SecretError", "load_secret",
           "load_secret_from_env", "load_secret_from_file", "logging_logger", "__version__"]
