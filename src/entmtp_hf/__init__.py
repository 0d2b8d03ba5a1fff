"""entmtp-hf: tree speculative decoding with MTP draft heads for Hugging Face transformers."""

__version__ = "0.1.0"
