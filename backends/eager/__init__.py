"""Plain-torch reference implementations of the aggregation ops."""
