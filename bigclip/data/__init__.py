"""Training and evaluation data: webdataset shards from disk or S3, decoded, transformed,
tokenized and batched by workers, with an exact, world-size-free position (resume/).
May import storage, config, distributed and errors.

    from bigclip.data.device import image_normalizer
    from bigclip.data.eval import load_eval_set
    from bigclip.data.resume.rank_state import continues_alone, merge_rank_states
    from bigclip.data.tokenizer import build_tokenizer
    from bigclip.data.train_data import TrainData
    from bigclip.data.validation import validate_data

    shards = validate_data(cfg.data, world_size=n)   # before building the model: DataError in seconds
    tokenizer = build_tokenizer(cfg.data.tokenizer, context_length=L, vocab_size=V)
    data = TrainData(cfg.data, rank=r, world_size=n, seed=s, image_size=S, tokenizer=tokenizer,
                     shards=shards)       # the run's data workers, started once
    loader = data.epoch(e, position=saved)   # a TrainLoader (loader.py; build_train_loader there for one alone)
    for batch in loader: ...            # TrainBatch(images, texts, keys), loader.py too
    mine = loader.rank_state()           # no collective; each rank saves its own (loader.py: the contract)
    same = continues_alone(mine, world_size=n, workers=w, batch_size=b, interleave=i, seed=s)
    position = mine if same else merge_rank_states(every_ranks_state)   # the latter: any world size
    held_out = load_eval_set(cfg.data.val_data, image_size=S, tokenizer=tokenizer)  # uint8 images
    normalize = image_normalizer(cfg.data, device=d, dtype=engine.image_dtype)  # uint8 -> model input

Module map: shards (patterns, existence, sizes, upsampling weights) -> streams (local / S3
bytes) -> tar_samples (samples + cursors) -> decode -> worker (read, transform to uint8, batch;
run by pool: persistent workers handed each epoch's jobs, their first opens spread by
open_schedule) -> batching + loader (consumer side: worker order, re-batching, epoch end;
accounting: what each epoch read against its plan and what it lost; train_data: a run's loaders
on one pool) -> device (normalisation on the GPU); validation checks all of it before a model is
built. resume/ holds who reads what (assignment), what has been consumed (position), how to
continue the same stream (reader_state, stream_state, randomness) and each rank's own share of
it (rank_state). transforms (+ augment: --aug-cfg), eval, tokenizer and index (`bigclip
index-shards`) stand alone.

The package imports nothing itself: `bigclip index-shards` and the flag checks import its
torch-free modules (shards, index) without importing torch.
"""
