from .denoiser import TinyDenoiser  # noqa: F401
