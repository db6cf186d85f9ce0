# Two limiterd regions: us-east in AWS us-east-1 and eu-west in eu-west-1.
# Each gets its Redis Cluster, its NATS cluster and its private zone; the
# NATS clusters are gateways of one supercluster, reached over a VPC peering
# or transit gateway between the two VPCs that this example assumes exists.
#
#   terraform init && terraform apply
#   terraform output -raw us_east_k8s_infra_env > ../../../k8s/overlays/us-east/infra.env
#   terraform output -raw eu_west_k8s_infra_env > ../../../k8s/overlays/eu-west/infra.env

module "us_east" {
  source    = "../../modules/region"
  providers = { aws = aws.us_east_1 }

  region_name               = "us-east"
  vpc_id                    = var.us_east.vpc_id
  subnet_ids                = var.us_east.subnet_ids
  client_security_group_ids = var.us_east.client_security_group_ids
  peer_vpcs                 = [{ vpc_id = var.eu_west.vpc_id, aws_region = "eu-west-1" }]

  redis_shards     = var.redis_shards
  redis_auth_token = var.redis_auth_tokens["us-east"]

  nats_ami_id              = var.us_east.nats_ami_id
  nats_gateways            = { "eu-west" = module.eu_west.nats_gateway_urls }
  nats_gateway_cidr_blocks = [var.eu_west.vpc_cidr]

  tags = var.tags
}

module "eu_west" {
  source    = "../../modules/region"
  providers = { aws = aws.eu_west_1 }

  region_name               = "eu-west"
  vpc_id                    = var.eu_west.vpc_id
  subnet_ids                = var.eu_west.subnet_ids
  client_security_group_ids = var.eu_west.client_security_group_ids
  peer_vpcs                 = [{ vpc_id = var.us_east.vpc_id, aws_region = "us-east-1" }]

  redis_shards     = var.redis_shards
  redis_auth_token = var.redis_auth_tokens["eu-west"]

  nats_ami_id              = var.eu_west.nats_ami_id
  nats_gateways            = { "us-east" = module.us_east.nats_gateway_urls }
  nats_gateway_cidr_blocks = [var.us_east.vpc_cidr]

  tags = var.tags
}
