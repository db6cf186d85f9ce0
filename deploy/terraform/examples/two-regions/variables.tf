variable "us_east" {
  description = "Network of limiterd region us-east (AWS us-east-1): the EKS cluster's VPC and CIDR, private subnets in 2+ zones, the security groups of its pods or nodes, and the NATS AMI."
  type = object({
    vpc_id                    = string
    vpc_cidr                  = string
    subnet_ids                = list(string)
    client_security_group_ids = list(string)
    nats_ami_id               = string
  })

  validation {
    condition     = can(regex("^vpc-", var.us_east.vpc_id)) && can(cidrhost(var.us_east.vpc_cidr, 0)) && length(var.us_east.subnet_ids) >= 2
    error_message = "us_east needs a vpc_id (vpc-...), a vpc_cidr and at least two subnet_ids."
  }
}

variable "eu_west" {
  description = "Network of limiterd region eu-west (AWS eu-west-1): the EKS cluster's VPC and CIDR, private subnets in 2+ zones, the security groups of its pods or nodes, and the NATS AMI."
  type = object({
    vpc_id                    = string
    vpc_cidr                  = string
    subnet_ids                = list(string)
    client_security_group_ids = list(string)
    nats_ami_id               = string
  })

  validation {
    condition     = can(regex("^vpc-", var.eu_west.vpc_id)) && can(cidrhost(var.eu_west.vpc_cidr, 0)) && length(var.eu_west.subnet_ids) >= 2
    error_message = "eu_west needs a vpc_id (vpc-...), a vpc_cidr and at least two subnet_ids."
  }
}

variable "redis_auth_tokens" {
  description = "Redis AUTH token of each region, by region name (us-east, eu-west); also put in each cluster's Secret limiterd-redis-auth."
  type        = map(string)
  sensitive   = true

  validation {
    condition     = length(setsubtract(["us-east", "eu-west"], keys(var.redis_auth_tokens))) == 0
    error_message = "redis_auth_tokens needs a token for us-east and for eu-west."
  }
}

variable "redis_shards" {
  description = "Redis Cluster primaries per region."
  type        = number
  default     = 3

  validation {
    condition     = var.redis_shards >= 1 && floor(var.redis_shards) == var.redis_shards
    error_message = "redis_shards must be a whole number, at least 1."
  }
}

variable "tags" {
  description = "Tags of every resource."
  type        = map(string)
  default     = { "app.kubernetes.io/part-of" = "limiterd" }

  validation {
    condition     = alltrue([for k, v in var.tags : length(k) <= 128 && length(v) <= 256])
    error_message = "Tag keys must be at most 128 characters and values at most 256."
  }
}
