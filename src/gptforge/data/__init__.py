"""Data stages: fetch a source (hub, URL or local file), validate it, write train/val/test splits."""
