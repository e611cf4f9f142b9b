"""Datasets: local jsonl/parquet files normalised into Problem records."""

from megatron_apriel.data.datasets import ProblemPools, load_problems, problem_to_row, row_to_problem, write_problems

__all__ = ["ProblemPools", "load_problems", "problem_to_row", "row_to_problem", "write_problems"]
