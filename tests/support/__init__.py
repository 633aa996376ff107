"""Helpers the tests share: spawned training and launch harnesses, engine and DCP readers,
OpenCLIP's reference code, and a fault-injecting S3 proxy. Not tests themselves.
"""
