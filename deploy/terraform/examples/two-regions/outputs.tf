output "us_east_k8s_infra_env" {
  description = "deploy/k8s/overlays/us-east/infra.env."
  value       = module.us_east.k8s_infra_env
}

output "eu_west_k8s_infra_env" {
  description = "deploy/k8s/overlays/eu-west/infra.env."
  value       = module.eu_west.k8s_infra_env
}

output "topology" {
  description = "The regions and their limiterd addresses, as in deploy/k8s/overlays/*/topology.yml."
  value = {
    regions = [
      { name = module.us_east.region_name, limiter_address = module.us_east.limiterd_address },
      { name = module.eu_west.region_name, limiter_address = module.eu_west.limiterd_address },
    ]
  }
}

output "images" {
  description = "The limiterd and reconciler images both regions run (the module's images output)."
  value       = module.us_east.images
}
