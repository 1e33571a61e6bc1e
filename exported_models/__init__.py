"""Exported models and the contract they follow (`model_format`); the default model ships here as package data.

The default model's name and path live here, not in model_format, so that the gunicorn master can read them
without importing TensorFlow (which must load only in the workers, after the fork).
"""
import os

DEFAULT_MODEL_NAME = "flowers"
DEFAULT_MODEL_BASE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEFAULT_MODEL_NAME)
