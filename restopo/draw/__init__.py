"""Pictures of the IR: Graphviz text (dot.py) and a matplotlib drawing for machines without
Graphviz (layout.py). `restopo graph` writes them to files."""
