"""The ClusterD sink: public faults, ClusterD's validation rules, request planning and delivery."""
