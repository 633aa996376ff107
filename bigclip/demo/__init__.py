"""`bigclip demo` and `bigclip make-demo-data`: synthetic captioned images, a loopback S3 endpoint
(moto, a dev dependency) and the end-to-end run on CPU ranks.
An offline tool: may import anything below cli; nothing in training imports it.
"""
