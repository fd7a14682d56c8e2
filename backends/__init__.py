"""Backends that run restopo aggregations: eager (reference), triton (fused), pipeline."""
