"""The sbatch template and cluster notes that ``megatron-ext launch`` renders (data files)."""
