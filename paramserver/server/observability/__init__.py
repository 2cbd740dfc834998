"""What a server shows about itself: hooks (no metrics library), Prometheus series, the status table
and the dashboard.
"""
