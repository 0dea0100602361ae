"""What the chapters share once a chapter has taught it."""
