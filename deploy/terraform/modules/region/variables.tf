variable "region_name" {
  description = "The limiterd region this module builds: --region of limiterd and the reconciler, a name in the topology, the NATS cluster and gateway name (e.g. us-east)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,30}$", var.region_name))
    error_message = "region_name must be lower-case letters, digits and dashes, not starting with a dash, at most 31 characters (it is part of AWS resource names)."
  }
}

variable "name_prefix" {
  description = "Prefix of every AWS resource name; the Redis replication group is <name_prefix>-<region_name> (at most 40 characters)."
  type        = string
  default     = "limiterd"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,7}$", var.name_prefix))
    error_message = "name_prefix must start with a letter, hold lower-case letters, digits and dashes, and be at most 8 characters."
  }
}

variable "vpc_id" {
  description = "VPC of the region's Kubernetes cluster, where Redis, NATS and the private DNS zone live."
  type        = string

  validation {
    condition     = can(regex("^vpc-[0-9a-f]{8,17}$", var.vpc_id))
    error_message = "vpc_id must be a VPC id, vpc-xxxxxxxx."
  }
}

variable "subnet_ids" {
  description = "Private subnets, in at least two availability zones, for the Redis nodes and the NATS servers."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2 && alltrue([for s in var.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", s))])
    error_message = "subnet_ids must hold at least two subnet ids (subnet-xxxxxxxx): Redis is multi-AZ."
  }
}

variable "client_security_group_ids" {
  description = "Security groups of the pods or nodes that run limiterd and the reconcilers: they may reach Redis (6379) and NATS (4222, and 8222 for monitoring)."
  type        = list(string)

  validation {
    condition     = length(var.client_security_group_ids) >= 1 && alltrue([for s in var.client_security_group_ids : can(regex("^sg-[0-9a-f]{8,17}$", s))])
    error_message = "client_security_group_ids must hold at least one security group id (sg-xxxxxxxx)."
  }
}

variable "dns_domain" {
  description = "Private DNS domain of the deployment; this region's zone is <region_name>.<dns_domain>, holding nats-N records and (written by external-dns) limiterd."
  type        = string
  default     = "limiterd.internal"

  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,63}$", var.dns_domain))
    error_message = "dns_domain must be a lower-case DNS name such as limiterd.internal."
  }
}

variable "peer_vpcs" {
  description = "The other regions' VPCs (id and AWS region): the zone is associated with them, so their NATS gateways and limiterd resolve this region's names over the peering or transit gateway."
  type = list(object({
    vpc_id     = string
    aws_region = string
  }))
  default = []

  validation {
    condition = alltrue([for p in var.peer_vpcs :
      can(regex("^vpc-[0-9a-f]{8,17}$", p.vpc_id)) && can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", p.aws_region))
    ])
    error_message = "Each peer_vpcs entry needs a vpc_id (vpc-xxxxxxxx) and an aws_region (e.g. eu-west-1)."
  }
}

variable "redis_node_type" {
  description = "ElastiCache node type of every Redis node. A check costs ~10 µs of Redis CPU and a bucket ~130 B (deploy/README.md, Sizing)."
  type        = string
  default     = "cache.r7g.large"

  validation {
    condition     = can(regex("^cache\\.[a-z0-9]+\\.[a-z0-9]+$", var.redis_node_type))
    error_message = "redis_node_type must be an ElastiCache node type such as cache.r7g.large."
  }
}

variable "redis_engine_version" {
  description = "Redis engine version, 7.x (the parameter group family is redis7)."
  type        = string
  default     = "7.1"

  validation {
    condition     = can(regex("^7\\.[0-9]+$", var.redis_engine_version))
    error_message = "redis_engine_version must be a Redis 7 version such as 7.1: the parameter group family is redis7."
  }
}

variable "redis_shards" {
  description = "Redis Cluster primaries (node groups): shards by client hash tag for throughput, ~50k checks/s each."
  type        = number
  default     = 3

  validation {
    condition     = var.redis_shards >= 1 && var.redis_shards <= 500 && floor(var.redis_shards) == var.redis_shards
    error_message = "redis_shards must be a whole number from 1 to 500."
  }
}

variable "redis_replicas_per_shard" {
  description = "Replicas of each primary, in other availability zones: automatic failover needs at least one."
  type        = number
  default     = 1

  validation {
    condition     = var.redis_replicas_per_shard >= 1 && var.redis_replicas_per_shard <= 5 && floor(var.redis_replicas_per_shard) == var.redis_replicas_per_shard
    error_message = "redis_replicas_per_shard must be a whole number from 1 to 5: multi-AZ failover needs a replica."
  }
}

variable "redis_auth_token" {
  description = "Redis AUTH token (transit encryption is on). The same value goes in the Kubernetes Secret limiterd-redis-auth, key password."
  type        = string
  sensitive   = true

  validation {
    condition     = length(var.redis_auth_token) >= 16 && length(var.redis_auth_token) <= 128 && can(regex("^[!#-.0-?A-~]+$", var.redis_auth_token))
    error_message = "redis_auth_token must be 16 to 128 printable ASCII characters without spaces, '\"', '/' or '@'."
  }
}

variable "redis_maintenance_window" {
  description = "Weekly maintenance window of the Redis nodes, ddd:hh24:mi-ddd:hh24:mi in UTC."
  type        = string
  default     = "sun:05:00-sun:06:00"

  validation {
    condition     = can(regex("^(mon|tue|wed|thu|fri|sat|sun):[0-2][0-9]:[0-5][0-9]-(mon|tue|wed|thu|fri|sat|sun):[0-2][0-9]:[0-5][0-9]$", var.redis_maintenance_window))
    error_message = "redis_maintenance_window must look like sun:05:00-sun:06:00."
  }
}

variable "nats_ami_id" {
  description = "AMI of the NATS servers: it must ship nats-server (v2.10 or later) as the systemd unit nats-server, running as user nats, reading /etc/nats/nats-server.conf."
  type        = string

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.nats_ami_id))
    error_message = "nats_ami_id must be an AMI id, ami-xxxxxxxx."
  }
}

variable "nats_instance_type" {
  description = "EC2 instance type of the NATS servers (its architecture must match the AMI's)."
  type        = string
  default     = "m6i.large"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.nats_instance_type))
    error_message = "nats_instance_type must be an EC2 instance type such as m6i.large."
  }
}

variable "nats_cluster_size" {
  description = "NATS servers in the region's cluster: 3 or 5, so JetStream keeps a quorum when one fails (the reconciler's --stream.replicas is at most this)."
  type        = number
  default     = 3

  validation {
    condition     = contains([3, 5], var.nats_cluster_size)
    error_message = "nats_cluster_size must be 3 or 5."
  }
}

variable "nats_volume_size_gb" {
  description = "Root volume of each NATS server in GiB; JetStream stores its files there."
  type        = number
  default     = 50

  validation {
    condition     = var.nats_volume_size_gb >= 20 && var.nats_volume_size_gb <= 16384 && floor(var.nats_volume_size_gb) == var.nats_volume_size_gb
    error_message = "nats_volume_size_gb must be a whole number from 20 to 16384."
  }
}

variable "nats_jetstream_max_file_gb" {
  description = "JetStream file storage limit of each NATS server in GiB: room for the four spend streams of the region (LIMITER_LOCAL_<REGION>, LIMITER_SPENDS_<REGION>, LIMITER_IN_<REGION>, LIMITER_RETRY_<REGION>), each up to the reconciler's --stream.max-bytes (1 GiB in deploy/k8s), one replica of each per server."
  type        = number
  default     = 16

  validation {
    condition     = var.nats_jetstream_max_file_gb >= 1 && floor(var.nats_jetstream_max_file_gb) == var.nats_jetstream_max_file_gb
    error_message = "nats_jetstream_max_file_gb must be a whole number of GiB, at least 1."
  }

  validation {
    condition     = var.nats_jetstream_max_file_gb <= var.nats_volume_size_gb - 8
    error_message = "nats_jetstream_max_file_gb must leave at least 8 GiB of nats_volume_size_gb to the system."
  }
}

variable "nats_gateways" {
  description = "The other regions' NATS gateway URLs, by region name (their modules' nats_gateway_urls output): this cluster's gateway connects to each, forming the supercluster that links the regions."
  type        = map(list(string))
  default     = {}

  validation {
    condition = alltrue([for name, urls in var.nats_gateways :
      can(regex("^[a-z0-9][a-z0-9-]{0,30}$", name)) && length(urls) > 0 &&
      alltrue([for u in urls : can(regex("^nats://[a-z0-9.-]+:[0-9]+$", u))])
    ])
    error_message = "nats_gateways must map region names to non-empty lists of nats://host:port URLs."
  }
}

variable "nats_gateway_cidr_blocks" {
  description = "CIDR blocks of the other regions' VPCs, allowed to reach this region's NATS gateway port (7222) and limiterd's internal NLB."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for c in var.nats_gateway_cidr_blocks : can(cidrhost(c, 0))])
    error_message = "nats_gateway_cidr_blocks must hold CIDR blocks such as 10.1.0.0/16."
  }
}

variable "tags" {
  description = "Tags added to every AWS resource of the module."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.tags : length(k) >= 1 && length(k) <= 128 && length(v) <= 256])
    error_message = "Tag keys must be 1 to 128 characters and values at most 256."
  }
}

variable "image_registry" {
  description = "Registry and namespace of the limiterd and reconciler images: make image builds ghcr.io/limiterd/<name>:<version>; give your own when you push them elsewhere (crane push)."
  type        = string
  default     = "ghcr.io/limiterd"

  validation {
    condition     = can(regex("^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$", var.image_registry))
    error_message = "image_registry must be a registry host with an optional port and path, such as ghcr.io/limiterd, without a trailing slash."
  }
}

variable "image_version" {
  description = "Tag of the images: the VERSION file make image tags them with. Pin digests in the overlay's kustomization (deploy/README.md)."
  type        = string
  default     = "0.1.0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", var.image_version))
    error_message = "image_version must be an image tag: letters, digits, _, . and -, at most 128, not starting with . or -."
  }
}
