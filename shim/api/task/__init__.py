"""The containerd Task API: processes, their states, and the service that serves them."""
