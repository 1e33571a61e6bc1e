"""Exported models and the contract they follow (`model_format`); the default model ships here as package data."""
