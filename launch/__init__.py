"""Cluster profiles, presets and sbatch rendering (installed as ``megatron_ext.launch``)."""
