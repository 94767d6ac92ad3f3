"""The gRPC API: ``tpserve/v1/tpserve.proto`` and its generated modules (``generate.py``)."""
