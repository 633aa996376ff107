"""The first torch release that has each torch name bigclip and its benchmarks use.

tests/test_torch_compat.py checks the code against this table: a name used but not listed, or
listed with a release newer than pyproject.toml's minimum, fails. To add a name, find the release
that introduced it in torch's sources (the pull request that added it and the release branch it
landed before, or the versioned docs) and write that evidence next to it.

IN_TORCH_2_0: long-standing API, present in torch 2.0 (2023-03) and unchanged in meaning since
(listed in torch_2_0_names.txt).
SINCE: newer names, each with its evidence. pytorch#N is github.com/pytorch/pytorch pull N.
Release branch cuts: 2.6 Dec 2024, 2.7 Mar 2025, 2.8 Jul 2025, 2.9 Sep 2025.
GUARDED: names bigclip reaches only through a fallback, so they may be newer than the minimum.
"""

from __future__ import annotations

from pathlib import Path

_D, _DCP = "torch.distributed", "torch.distributed.checkpoint"

IN_TORCH_2_0 = frozenset(
    line
    for line in (Path(__file__).with_name("torch_2_0_names.txt").read_text().splitlines())
    if line and not line.startswith("#")
)

_CUT_2_6 = "merged Nov 2024, before the 2.6 branch cut"
_DCP_2_2 = "the DCP save/load API with storage_writer/storage_reader/process_group (torch 2.2 release notes)"
_STAGER = (
    "DefaultStager/StagingOptions: `.. versionadded:: 2.9` (pytorch/tutorials#3711, async checkpoint recipe)"
)

_HF_DCP = "HuggingFaceStorageWriter(save_distributed=, enable_consolidation=) and consolidation: torch >= 2.9 (ByteDance-Seed/VeOmni#461)"

_SAC = "selective activation checkpointing public in torch.utils.checkpoint (torch 2.4 release notes, pytorch#125795)"

SINCE: dict[str, tuple[str, str]] = {
    # -- fp8: the float8 GEMM the fp8 linear kinds run (and selective checkpointing keeps)
    "torch.ops.aten._scaled_mm": ("2.1", "aten::_scaled_mm in native_functions.yaml of the v2.1.0 tag"),
    "torch.ops.aten._scaled_mm.default": (
        "2.1",
        "aten::_scaled_mm in native_functions.yaml of the v2.1.0 tag",
    ),
    # -- activation checkpointing
    "torch.utils.checkpoint.CheckpointPolicy": ("2.4", _SAC),
    "torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE": ("2.4", _SAC),
    "torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE": ("2.4", _SAC),
    "torch.utils.checkpoint.create_selective_checkpoint_contexts": ("2.4", _SAC),
    # -- collectives and process groups
    f"{_D}.P2POp(group_peer=)": ("2.6", f"pytorch#141054 'Support group ranks in P2POp', {_CUT_2_6}"),
    f"{_D}.broadcast_object_list(group_src=)": ("2.6", f"pytorch#140843/#140847 group_src, {_CUT_2_6}"),
    f"{_D}.gather_object(group_dst=)": ("2.6", f"pytorch#140827 group_dst in gather(+object), {_CUT_2_6}"),
    f"{_D}.init_process_group(device_id=)": ("2.3", "device_id (eager NCCL init), torch 2.3 docs"),
    "torch.testing._internal.distributed.fake_pg.FakeStore": ("2.1", "fake process group for tests"),
    # -- FSDP2 and DTensor
    f"{_D}.fsdp.fully_shard": ("2.6", "FSDP2 public as torch.distributed.fsdp.fully_shard in 2.6"),
    f"{_D}.fsdp.fully_shard(mesh=)": ("2.6", "fully_shard's signature since its public release"),
    f"{_D}.fsdp.fully_shard(mp_policy=)": ("2.6", "fully_shard's signature since its public release"),
    f"{_D}.fsdp.fully_shard(reshard_after_forward=)": (
        "2.6",
        "fully_shard's signature since its public release",
    ),
    f"{_D}.fsdp.fully_shard(ignored_params=)": (
        "2.7",
        "pytorch#146631 'Support ignoring parameters in FSDP2', Feb 2025",
    ),
    f"{_D}.fsdp.MixedPrecisionPolicy": (
        "2.6",
        "exported with fully_shard from torch.distributed.fsdp in 2.6",
    ),
    f"{_D}.fsdp.MixedPrecisionPolicy(param_dtype=)": ("2.6", "MixedPrecisionPolicy field"),
    f"{_D}.fsdp.MixedPrecisionPolicy(reduce_dtype=)": ("2.6", "MixedPrecisionPolicy field"),
    f"{_D}.device_mesh.init_device_mesh": ("2.2", "DeviceMesh public in torch 2.2"),
    f"{_D}.tensor.DTensor": ("2.5", "torch.distributed.tensor public in 2.5 (was torch.distributed._tensor)"),
    f"{_D}.tensor.Shard": ("2.5", "torch.distributed.tensor public in 2.5"),
    f"{_D}.tensor.distribute_tensor": ("2.5", "torch.distributed.tensor public in 2.5"),
    f"{_D}.tensor.DTensor.from_local": ("2.5", "torch.distributed.tensor public in 2.5"),
    f"{_D}.tensor.DTensor.from_local(run_check=)": ("2.5", "from_local's signature in 2.5"),
    f"{_D}.tensor.DTensor.from_local(shape=)": ("2.5", "from_local's signature in 2.5 (uneven shards)"),
    f"{_D}.tensor.DTensor.from_local(stride=)": ("2.5", "from_local's signature in 2.5 (uneven shards)"),
    f"{_D}.tensor.distribute_tensor(src_data_rank=)": (
        "2.7",
        "pytorch#143883, merged Jan 2025, after the 2.6 cut",
    ),
    # -- distributed checkpoint
    f"{_DCP}.load(no_dist=)": ("2.3", "no_dist on save/load, torch 2.3 docs"),
    f"{_DCP}.load": ("2.2", _DCP_2_2),
    f"{_DCP}.save": ("2.2", _DCP_2_2),
    f"{_DCP}.save(storage_writer=)": ("2.2", _DCP_2_2),
    f"{_DCP}.save(no_dist=)": ("2.3", "no_dist on save/load, torch 2.3 docs"),
    f"{_DCP}.HuggingFaceStorageWriter(save_distributed=)": ("2.9", _HF_DCP),
    f"{_DCP}.HuggingFaceStorageWriter(enable_consolidation=)": ("2.9", _HF_DCP),
    # DCP's own Hugging Face safetensors path (benchmarks/consolidate.py measures it): public as
    # HuggingFaceStorageWriter after pytorch#148361 (Mar 2025, private-prefixed then); its
    # distributed save with consolidation is gated on torch >= 2.9 by its users (VeOmni#461).
    f"{_DCP}.HuggingFaceStorageWriter": ("2.9", _HF_DCP),
    f"{_DCP}._consolidate_hf_safetensors.consolidate_safetensors_files": ("2.9", _HF_DCP),
    f"{_DCP}.load(storage_reader=)": ("2.2", _DCP_2_2),
    f"{_DCP}.load(process_group=)": ("2.2", _DCP_2_2),
    f"{_DCP}.load(planner=)": ("2.2", _DCP_2_2),
    f"{_DCP}.staging.DefaultStager": ("2.9", _STAGER),
    f"{_DCP}.staging.StagingOptions": ("2.9", _STAGER),
    f"{_DCP}.staging.StagingOptions(use_async_staging=)": ("2.9", _STAGER),
    f"{_DCP}.staging.StagingOptions(use_non_blocking_copy=)": ("2.9", _STAGER),
    f"{_DCP}.staging.StagingOptions(use_pinned_memory=)": ("2.9", _STAGER),
    f"{_DCP}.staging.StagingOptions(use_shared_memory=)": ("2.9", _STAGER),
    f"{_DCP}.filesystem.FileSystem": ("2.2", "FileSystem/FileSystemBase split for fsspec, 2.2"),
    f"{_DCP}._fsspec_filesystem.FsspecReader": (
        "2.1",
        "pytorch#98387 added _fsspec_filesystem.py (merged Apr 2023, before the 2.1 cut); still there, "
        "private, in 2026 (pytorch#188772 proposes making it public)",
    ),
    f"{_DCP}._fsspec_filesystem.FsspecWriter": ("2.1", "added with FsspecReader by pytorch#98387"),
    f"{_DCP}._fsspec_filesystem.FsspecWriter(sync_files=)": (
        "2.1",
        "pytorch#98387: FsspecWriter(path, single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead)",
    ),
    f"{_DCP}._fsspec_filesystem.FsspecWriter(thread_count=)": ("2.1", "the same signature, pytorch#98387"),
    f"{_DCP}.filesystem.FileSystemBase": ("2.2", "FileSystem/FileSystemBase split for fsspec, 2.2"),
    f"{_DCP}.filesystem._StorageReaderTransforms": (
        "2.8",
        "in filesystem.py beside SerializationFormat/_hf_utils and Optional/Union typing (2.8-era source)",
    ),
    f"{_DCP}.metadata.StorageMeta": ("2.4", "StorageMeta in DCP metadata, 2.4 (dcp format_utils release)"),
    f"{_DCP}._traverse.set_element": ("2.2", "DCP state-dict traversal helpers, 2.2"),
    f"{_DCP}.stateful.Stateful": ("2.2", "Stateful protocol, 2.2 DCP docs"),
    f"{_DCP}.state_dict.StateDictOptions": ("2.2", "torch.distributed.checkpoint.state_dict, 2.2"),
    f"{_DCP}.state_dict.StateDictOptions(full_state_dict=)": ("2.2", "StateDictOptions field"),
    f"{_DCP}.state_dict.get_model_state_dict": ("2.2", "torch.distributed.checkpoint.state_dict, 2.2"),
    f"{_DCP}.state_dict.get_model_state_dict(options=)": ("2.2", "get_model_state_dict's signature"),
    f"{_DCP}.state_dict.set_model_state_dict": ("2.2", "torch.distributed.checkpoint.state_dict, 2.2"),
    # -- core
    "torch.OutOfMemoryError": (
        "2.5",
        "device-generic torch.OutOfMemoryError (torch.cuda.OutOfMemoryError aliases it)",
    ),
    # -- the gradient norm and clipping in multi-tensor kernels (engines/optimizer.py)
    "torch._foreach_norm": (
        "2.0",
        "clip_grad_norm_'s foreach path calls it (pytorch#91846, merged Jan 2023, before the 2.0 cut)",
    ),
    "torch.arange(dtype=)": (
        "2.0",
        "a factory function's dtype keyword, as torch.arange(device=) (torch 2.0 docs)",
    ),
    "torch._foreach_norm(dtype=)": (
        "2.11",
        "asked for in pytorch#125040 (Apr 2024), so 2.4 or later; the declared minimum's schema has it "
        "(aten::_foreach_norm.Scalar(Tensor[] self, Scalar ord=2, ScalarType? dtype=None), read on 2.11.0)",
    ),
    "torch._foreach_mul_": (
        "2.3",
        "the 0-dim Tensor overload (no host sync): missing in Aug 2023 (pytorch#106427), used by "
        "pytorch#120910's DTensor clip_grad_norm_ (Feb 2024, before the 2.3 cut)",
    ),
    "torch._foreach_copy_": (
        "2.1",
        "in-place foreach copy, pytorch#107226 (merged Aug 2023, before the 2.1 cut; fixes pytorch#107162)",
    ),
    "torch._int_mm": ("2.1", "int8 x int8 -> int32 matmul (CUDA 2.1; CPU by 2.3)"),
    "torch.float8_e4m3fn": ("2.1", "float8 dtypes, 2.1 release notes"),
    "torch.float8_e5m2": ("2.1", "float8 dtypes, 2.1 release notes"),
    "torch.load(mmap=)": ("2.1", "torch.load mmap, 2.1 release notes"),
    "torch.get_autocast_dtype": ("2.4", "device-generic autocast getters, 2.4"),
    "torch.library.custom_op": ("2.4", "torch.library.custom_op, 2.4 release notes"),
    "torch.library.custom_op(mutates_args=)": ("2.4", "custom_op's signature"),
    "torch.optim.AdamW(fused=)": ("2.4", "fused AdamW: CUDA 2.0, CPU 2.4 release notes"),
    "torch.mm(out_dtype=)": (
        "2.8",
        "pytorch#150812 fp32 output from bf16/fp16 GEMMs; torch.bmm docs/2.8 list out_dtype",
    ),
    "torch.utils._pytree.tree_leaves": ("2.1", "torch.utils._pytree.tree_leaves"),
}

# Names checked present in torch 2.11.0, the declared minimum, without looking up the release that
# added them: each resolved (attribute, or keyword in the signature) in the low stack's torch, and
# the code using it runs in the low stack's tests. The bound is the minimum, not the first release.
_IN_MINIMUM = (
    "resolved in torch 2.11.0 (the low stack, .venv-low), the declared minimum; first release not looked up"
)
SINCE |= {
    name: ("2.11", _IN_MINIMUM)
    for name in (
        "torch.Tensor._make_wrapper_subclass",
        "torch.Tensor._make_wrapper_subclass(device=)",
        "torch.Tensor._make_wrapper_subclass(dtype=)",
        "torch.Tensor._make_wrapper_subclass(requires_grad=)",
        "torch._C._disabled_torch_function_impl",
        "torch._dynamo.callback_handler",
        "torch._dynamo.callback_handler.register_end_callback",
        "torch._dynamo.callback_handler.register_start_callback",
        "torch.distributed.checkpoint.DefaultSavePlanner",
        "torch.distributed.checkpoint.default_planner.create_default_global_save_plan",
        "torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION",
        "torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.distributed.checkpoint.filesystem._StoragePrefix",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata(offsets=)",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata(sizes=)",
        "torch.distributed.checkpoint.metadata.Metadata(planner_data=)",
        "torch.distributed.checkpoint.metadata.Metadata(state_dict_metadata=)",
        "torch.distributed.checkpoint.metadata.Metadata(storage_data=)",
        "torch.distributed.checkpoint.metadata.Metadata(storage_meta=)",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorProperties(dtype=)",
        "torch.distributed.checkpoint.metadata.TensorProperties(layout=)",
        "torch.distributed.checkpoint.metadata.TensorProperties(memory_format=)",
        "torch.distributed.checkpoint.metadata.TensorProperties(pin_memory=)",
        "torch.distributed.checkpoint.metadata.TensorProperties(requires_grad=)",
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.SavePlan(planner_data=)",
        "torch.distributed.checkpoint.planner.SavePlanner",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.planner.TensorWriteData(chunk=)",
        "torch.distributed.checkpoint.planner.TensorWriteData(properties=)",
        "torch.distributed.checkpoint.planner.TensorWriteData(size=)",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItem(index=)",
        "torch.distributed.checkpoint.planner.WriteItem(tensor_data=)",
        "torch.distributed.checkpoint.planner.WriteItem(type=)",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.distributed.checkpoint.planner.WriteItemType.BYTE_IO",
        "torch.distributed.checkpoint.planner.WriteItemType.SHARD",
        "torch.distributed.checkpoint.planner.WriteItemType.TENSOR",
        "torch.distributed.checkpoint.planner_helpers._create_chunk_list",
        "torch.distributed.checkpoint.storage.WriteResult",
        "torch.distributed.tensor.placement_types.Shard",
        "torch.distributed.tensor.placement_types.Shard.local_shard_size_and_offset",
        "torch.strided",
        "torch.utils.data.DataLoader(persistent_workers=)",
    )
}

# Names reached only through a fallback: name -> where the fallback lives.
GUARDED: dict[str, str] = {
    f"{_D}.all_gather_single": "bigclip/ops/loss/collectives.py falls back to all_gather_into_tensor (torch < 2.13)",
    f"{_D}.reduce_scatter_single": "bigclip/ops/loss/collectives.py falls back to reduce_scatter_tensor (torch < 2.13)",
}


def first_release(name: str) -> str | None:
    """The first torch release with `name`, or None when the table does not know it."""
    if name in IN_TORCH_2_0:
        return "2.0"
    return SINCE[name][0] if name in SINCE else None
