"""Serving pieces shared by the predictor and the HTTP server: errors, limits, request images."""
