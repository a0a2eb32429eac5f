"""The radix page cache both workers keep (radix.py), its scoped invalidation and its check."""
