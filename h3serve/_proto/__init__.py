"""Generated gRPC modules of `protos/h3serve/v1` (regenerate with `python -m h3serve._proto.generate`)."""

GENERATED_WITH = "1.85.1"  # grpcio-tools version the committed modules were generated with
