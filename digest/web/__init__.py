"""The digest's read-only web view (`nightshift digest serve`)."""
