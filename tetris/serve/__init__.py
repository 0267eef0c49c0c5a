"""Serving: the Ray Serve app (ingress, dispatcher, pools), the OpenAI wire format and metrics."""
