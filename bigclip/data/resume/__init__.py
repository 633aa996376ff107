"""The data stream's exact position: which reader reads which shards (assignment), what has been
consumed (position), how each reader continues (reader_state, stream_state), and every random
choice keyed by where it is made (randomness). Imports only data's lower modules and errors.
"""
