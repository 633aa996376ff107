"""Data: webdataset pipeline (local or S3), transforms, tokenizer, demo-data generator."""
