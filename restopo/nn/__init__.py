"""restopo's torch modules: the reference transformer's sublayers (sublayers.py), its Parts
(model.py) and the aggregation modules the lowering builds from the IR (aggregate.py)."""
