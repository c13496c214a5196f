"""FuseMix: multimodal alignment of two frozen encoders by training adapters on their cached
latents (docs/fusemix.md)."""
