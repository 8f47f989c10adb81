"""Cluster profiles for ``megatron-ext launch``: what differs between the clusters we run on.

A profile is data: the sbatch template (``slurm/job.sbatch.tmpl``) is the same for all of them
and takes from the profile the GPUs and CPUs per node, the extra ``srun`` options, the kind of
container and the environment exported before ``srun``. Why each value is what it is:
``slurm/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str
    # One Slurm task per GPU. None: the cluster's nodes differ; --gpus-per-node must be given.
    gpus_per_node: int | None
    cpus_per_task: int
    # Options of the training step's srun, besides the CPUs per task and the container.
    srun_options: tuple[str, ...] = ()
    # "edf": CSCS Container Engine (srun --environment=EDF); "pyxis": srun --container-image.
    container: str = "pyxis"
    # Exported in the batch script before srun (srun passes the environment to every task).
    env: dict[str, str] = field(default_factory=dict)
    # Comment lines written above those exports: what is deliberately left out, and how to tune.
    env_notes: tuple[str, ...] = ()
    gpu_memory_gb: float | None = None  # per GPU, as the vendor states it (10^9 bytes)


PROFILES: dict[str, ClusterProfile] = {
    profile.name: profile
    for profile in (
        ClusterProfile(
            name="alps-gh200",
            description="CSCS Alps (Clariden, ...): 4 GH200 per aarch64 Grace node, Slingshot",
            gpus_per_node=4,
            gpu_memory_gb=96,  # GH200 with 96 GB HBM3
            cpus_per_task=72,  # 288 Grace cores per node, 72 per GPU
            # pmix: required by the alps images; disable_rdzv_get: CSCS's advice for NCCL over
            # libfabric/CXI (alps-extended-images docs).
            srun_options=("--mpi=pmix", "--network=disable_rdzv_get"),
            container="edf",
            # NCCL, not Cray MPICH, moves GPU data (CSCS NCCL page).
            env={"MPICH_GPU_SUPPORT_ENABLED": "0"},
            env_notes=(
                "Slingshot: NCCL's libfabric/CXI settings (NCCL_NET=\"AWS Libfabric\", FI_PROVIDER=cxi,",
                "FI_CXI_*, NCCL_SOCKET_IFNAME=hsn, NCCL_PROTO=^LL128, ...) come from the alps container",
                "image and are deliberately not set here. The EDF must set entrypoint = true,",
                "[env] PMIX_MCA_psec = \"native\" and [annotations] com.hooks.cxi.enabled = \"false\".",
            ),
        ),
        ClusterProfile(
            name="h100-ib",
            description="8 x H100 per node, InfiniBand (NCCL's IB transport), optional pyxis/enroot",
            gpus_per_node=8,
            gpu_memory_gb=80,  # H100 SXM 80 GB
            cpus_per_task=12,  # 96+ cores per node on common 8 x H100 nodes
            container="pyxis",
            env={"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
            env_notes=(
                "InfiniBand: NCCL detects the HCAs itself. Where the cluster needs them pinned or",
                "tuned, pass --env NAME=VALUE to megatron-ext launch, e.g.",
                "  --env NCCL_IB_HCA=mlx5_0,mlx5_1,...   (the compute HCAs: ibv_devinfo -l)",
                "  --env NCCL_SOCKET_IFNAME=<bootstrap interface>",
                "  --env NCCL_IB_SL=1 --env NCCL_IB_TIMEOUT=19   (NVIDIA's Megatron examples)",
            ),
        ),
        ClusterProfile(
            name="generic",
            description="any Slurm cluster: give --gpus-per-node (and --cpus-per-task)",
            gpus_per_node=None,
            cpus_per_task=8,
            container="pyxis",
            env_notes=("Network: NCCL's defaults; add --env NAME=VALUE for the cluster's settings.",),
        ),
    )
}


def get_profile(name: str) -> ClusterProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown cluster profile {name!r}; known: {', '.join(PROFILES)}") from None
