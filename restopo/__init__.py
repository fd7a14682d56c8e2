"""restopo: a language and compiler for the residual topologies of transformers."""
__version__ = "0.1.0"
