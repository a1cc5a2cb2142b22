"""Static-KV Llama-family decoders and their Hugging Face checkpoint loader."""
from .config import SUPPORTED_ARCHITECTURES, ModelArgs, UnsupportedModelError
from .llama import Transformer
from .loader import CheckpointError, load_model, parse_dtype, read_config

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArgs", "Transformer", "CheckpointError", "UnsupportedModelError",
           "load_model", "parse_dtype", "read_config"]
