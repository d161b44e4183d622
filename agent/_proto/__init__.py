"""Generated protobuf and gRPC stubs (proto/generate.py); do not edit."""
